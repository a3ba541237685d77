// The SIMD code every ISA shares, once per ISA: quant_layout.h includes this file with ZI_ISA
// naming the vector traits (`Avx2`, `Avx512`) and ZI_TARGET their target attribute. No include
// guard: each inclusion defines the overloads of one ISA.

// sum over groups of (min - zero * scale) * xsum[g], I::W groups a step: the part of a row's
// product that does not depend on q (the decode kernels add it to the integer part).
ZI_TARGET ZI_INLINE float offset_dot(ZI_ISA, const QW& w, int64_t row, const float* xsum) {
  using I = ZI_ISA;
  const int64_t ng = w.k / w.group;
  const float* sp = w.scale + row * ng;
  const float* mp = w.minv ? w.minv + row * ng : nullptr;
  const I::V z = I::set1(static_cast<float>(w.tile_zero()));
  I::V acc = I::zero();
  int64_t g = 0;
  for (; g + I::W <= ng; g += I::W) {
    const I::V mv = mp ? I::load(mp + g) : I::zero();
    acc = I::fmadd(I::fnmadd(z, I::load(sp + g), mv), I::load(xsum + g), acc);
  }
  if (g < ng) {                      // the last groups: masked loads, zeros in the unused lanes
    const int64_t n = ng - g;
    const I::V mv = mp ? I::load_n(mp + g, n) : I::zero();
    acc = I::fmadd(I::fnmadd(z, I::load_n(sp + g, n), mv), I::load_n(xsum + g, n), acc);
  }
  return I::sum(acc);
}

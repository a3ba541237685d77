"""Model zoo: YAML specs, the registry of layer kinds, layer modules, the builder and the weight loader."""
from models.builder import CausalLM, build_model
from models.loader import WeightError, load_weights
from models.spec import ModelSpec, SpecError, load_spec


def resolve_spec(path) -> ModelSpec:
    """A zoo YAML file, or an HF checkpoint directory (spec derived from config.json)."""
    from pathlib import Path
    p = Path(path)
    if p.is_dir():
        from models.import_hf import spec_from_hf_dir
        return spec_from_hf_dir(p)
    if not p.exists():
        raise SpecError(f"{p}: no such spec file or checkpoint directory")
    return load_spec(p)


__all__ = ["CausalLM", "build_model", "WeightError", "load_weights", "ModelSpec", "SpecError",
           "load_spec", "resolve_spec"]

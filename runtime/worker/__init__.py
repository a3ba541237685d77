"""The worker side: what runs the model for the scheduler's decisions.

`ModelRunner` applies each SchedulerOutput to the persistent batch (`InputBatch`, with a
`MultiGroupBlockTable` per request row), plans attention once per KV cache group
(`step_plan`), runs the forward (eager, compiled, or a CUDA graph replay: `cuda_graphs`)
and samples (`Sampler`). Nothing here decides what to schedule; the core (`Scheduler`,
`Engine`) never touches tensors.
"""

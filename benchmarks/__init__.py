"""The project's benchmarks. Each `bench_*` module is a script, run from the repository root as
`python -m benchmarks.bench_x --help`; the other modules are what the scripts share:

  harness        timing, one JSON line per result, `radixlm serve` / `router` processes (the
                 tests start their servers with it too)
  cpu_noise      how much of the machine other processes used during a run
  gpu_measure    GPU timing and the device's ceilings (bandwidth, GEMM rate, CUDA graph replays)
  engine_runs    timing an in-process Engine: decode ms/token, the offline run, step split, profiles
  gpu_workloads  the GPU benchmarks' token-id workloads
  models         the model shapes and the Llama-3 tokenizer the GPU benchmarks and tests use
  hf_baseline, serving_datasets, lang_workloads, spec_workloads  baselines and workloads
"""

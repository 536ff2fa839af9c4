"""Process entry points: one module per process the runtime starts (the main process's is
srt/launch.py, `radixlm serve`)."""

"""The contract between the scheduling policy (srt/scheduler/) and the device engine
(srt/executor/): the request record the policy keeps, the step plan it hands the engine, and
the result the engine gives back. Neither side imports the other; both import this. No torch."""

"""`radixlm router` and `radixlm serve --dp-size N`: an HTTP front that spreads requests over
replicas of `radixlm serve`, sending each to the replica most likely to hold its prompt's prefix
in its radix cache.

  prefix_tree.py   the router's approximate radix tree of what it sent to each worker
  request_keys.py  the text a request is routed by (native, completions, chat, responses)
  policy.py        cache_aware | round_robin | least_load: which worker gets a request
  workers.py       the workers, their loads and health checks
  proxy.py         forwarding with retries, streams relayed event by event
  worker_metrics.py  /metrics: the workers' samples labelled by worker, the router's counters
  app.py           the FastAPI routes
  cli.py           `radixlm router` (flags, serving)
  dp_launcher.py   `radixlm serve --dp-size N`: N local replicas behind the router
"""

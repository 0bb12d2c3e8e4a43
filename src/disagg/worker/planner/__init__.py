"""Capacity planning for a deployment: how many prefill and decode replicas serve a request mix
within its latency SLOs (goodput, as DistServe defines it), predicted from a measured engine
profile by simulation. `disagg plan` prints it."""

"""Autoscaling of the prefill and decode pools: prefill on TTFT, decode on ITL.

Pure parts (no I/O): `spec` (the CRD section, validated), `metrics` (Prometheus text and
histogram arithmetic), `control` (the control law), `hpa` (the HorizontalPodAutoscaler
builder). I/O parts: `scrape` (pods' `/metrics`), `prometheus` (PromQL), `ownership` (the one owner of
an autoscaled StatefulSet's replicas: scaling, and undoing anyone else's change), `handlers`
(the kopf timer and watch that tie them together, over the operator's own API client),
`state` (per-deployment memory and the status it writes), `telemetry` (the autoscaler's own
Prometheus metrics).
"""

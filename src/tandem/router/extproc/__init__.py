"""The router as a Gateway API Inference Extension endpoint picker (EPP).

`tandem router --ext-proc-port N` serves Envoy's External Processing service
(`envoy.service.ext_proc.v3.ExternalProcessor/Process`, protos from the `xds-protos` package)
beside the HTTP front door, in the same process and event loop, over the same `RouterApp`
(scheduler, index, scorers, P/D decision, monitors, metrics). A gateway (Envoy, Istio,
kgateway, GKE Gateway, Envoy AI Gateway) asks it where each request of an `InferencePool`
goes, as the extension's endpoint-picker protocol specifies:

* `settings`: what the EPP serves (port, TLS, InferenceObjective priorities, fallbacks);
* `encode`: the protocol's messages (destination header + `envoy.lb` metadata, streamed
  bodies, immediate responses, the subset hint and served-endpoint metadata);
* `picker`: one request's decision through the router's own stages (`router.stages`);
* `stream`: the per-stream state machine (FULL_DUPLEX_STREAMED request and response bodies);
* `service`: the gRPC servicer and the health services (`liveness`, `readiness`, and the
  ext_proc service's name);
* `server`: start and stop (plaintext, or TLS with a certificate and key).

Only `settings` is imported by the router at start-up; the rest load when the port is set.
"""

"""The InferenceService operator: `spec` (the CR's spec as dataclasses), `render` (pure
spec -> manifests), and the running operator (`main`: kopf handlers over `reconcile`,
`status`, `autoscale`, `metrics`, `kube`; `cli`: `tandem operator`). Imports neither torch
nor `tandem.engine` (a test enforces it)."""

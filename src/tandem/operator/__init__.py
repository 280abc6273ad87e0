"""The InferenceService operator: `spec` (the CR's spec as dataclasses) and `render` (pure
spec -> manifests). Imports neither torch nor `tandem.engine` (a test enforces it)."""

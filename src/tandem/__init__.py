"""Tandem: Kubernetes-native LLM serving."""

"""kopf operator for InferenceService resources (arrives with issue [5/5])."""

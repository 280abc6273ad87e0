"""Weight quantization: linear methods behind one registry (`base.py`), applied to a model
built on the meta device (`apply.py`) so the model code stays plain."""

"""Prefill-role worker: the shared worker server (`tandem.serving`) with `--role prefill`.

`python -m tandem.prefill_worker [worker args]` is `tandem worker --role prefill ...`. What
differs by role (KV hand-off to decode workers) arrives with issue [4/5].
"""

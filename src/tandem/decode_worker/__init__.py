"""Decode-role worker: the shared worker server (`tandem.serving`) with `--role decode`.

`python -m tandem.decode_worker [worker args]` is `tandem worker --role decode ...`. What
differs by role (KV hand-off to decode workers) arrives with issue [4/5].
"""

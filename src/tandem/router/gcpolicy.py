"""The router process's garbage-collector policy: keep full collections short.

A full collection walks every container object the process holds. The router's big state
(the prefix index, `index_packed`) lives in numpy arrays and untracked dicts of ints, so
what remains is what startup leaves behind: imported modules, the app, the config, the
tokenizers, the workers (~60k objects, ~40 ms a pass). `settle()` collects once after
startup and freezes the survivors (`gc.freeze`), so later collections walk only what
requests allocate since.
"""

from __future__ import annotations

import gc


def settle() -> int:
    """Collect, then move every surviving object out of the collector's sight; returns
    how many objects are frozen. Call once, when startup is done."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

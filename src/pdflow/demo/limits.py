"""The demo's input bounds: light to import, so the CLI's help text states the same numbers the
checks enforce (pdflow.demo.run.check_options)."""

from __future__ import annotations

UPPER_BOUNDS = {"requests": 10_000, "prompt_len": 2_048, "max_new": 1_024, "concurrency": 256}
"""What one demo run on a laptop can hold and finish; past these it runs out of memory or time."""
SEED_LIMIT = 1 << 63
"""Seeds run from 0 to this, exclusive: torch's generators take no more."""

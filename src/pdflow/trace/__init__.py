"""Protocol traces: one JSON line per core step, enough to replay every endpoint exactly."""

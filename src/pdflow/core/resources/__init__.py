"""Resources an endpoint allocates: the page ledger, the staging ring and the admission queue."""

"""Per-room machines: the sender room, the receiver room and the prefill-complete table."""

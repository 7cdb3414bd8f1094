"""The protocol vocabulary: wire messages, room inputs and outputs, allocation policy."""

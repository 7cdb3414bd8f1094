"""Endpoints: one rank hosting many rooms, routing inputs to them and owning their resources."""

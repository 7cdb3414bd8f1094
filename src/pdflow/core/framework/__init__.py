"""The machine framework: the table driver, steps, typed errors, KVPoll and deadlines."""

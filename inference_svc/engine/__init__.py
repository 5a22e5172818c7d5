"""The engine: the scheduler (which job gets which slot, when) and the executor that runs its
units on the decoding core, with the draft-length controller. Owns the queue and the slots'
contexts; may import the core binding, config, errors, metrics and the shared types, never
sessions or a file format."""

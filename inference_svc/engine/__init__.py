"""The engine: the scheduler (which job gets which slot, when), the executor that runs its
units on its one thread, the slot owner (the contexts and decoder: the only code that changes
a slot's content), and the draft-length controller. May import the core binding, config,
errors, metrics and the shared types, never sessions (it calls them through the
SessionHooks protocol it defines) or a file format."""

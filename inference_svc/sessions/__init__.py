"""Sessions: named conversations that outlive their slot (slot, RAM and store tiers), their
names and listing, and the conversation kept in their slot files. May import the engine, storage
and the snapshot client package (through a slot store)."""

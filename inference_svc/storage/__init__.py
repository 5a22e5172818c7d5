"""Where slot files come from and go to: the slot file format, core state <-> slot files, the
slot stores (local directory, snapshot service, its replicas, the stop's fallback), slot
save/restore/erase and the auto-save. May import the core's header and error types, the
engine (to run slot operations on its thread, through the slot owner) and the snapshot client
package."""

"""The per-host transport daemon: the server (:mod:`.server`), its configuration (:mod:`.config`),
the trainer <-> daemon messages (:mod:`.messages`), the trainer's client plane (:mod:`.client`,
:class:`~.client.DaemonPlane`), shared-memory segments (:mod:`.shm`) and metrics
(:mod:`.metrics`)."""

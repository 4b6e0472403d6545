"""``/v1/videos`` on the server: OpenAI's video API over a crash-safe job queue and worker processes.

Modules: ``jobs`` (the job-store interface: leases, fencing), its backends ``sqlite_store`` (one machine) and
``postgres_store`` (a fleet), ``stores`` (open one from an address), ``request`` (request checks), ``uploads``
(reference images), ``worker`` (one process: the loaded model and the job loop), ``worker_pool`` (a machine's
workers and their supervision), ``service`` (store, clips folder, workers, request checks),
``routes`` (the HTTP routes), ``metrics`` (Prometheus series from the store), ``attach`` (one app for the LLM and
video routes). Importing this package imports nothing heavy.
"""

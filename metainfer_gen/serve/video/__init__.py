"""``/v1/videos`` on the server: OpenAI's video API over a crash-safe job queue and worker processes.

Modules: ``jobs`` (the SQLite job store), ``request`` (request checks), ``uploads`` (reference images),
``worker`` (one process: the loaded model and the job loop), ``service`` (data folder, workers, supervision),
``routes`` (the HTTP routes), ``metrics`` (Prometheus series from the store), ``attach`` (one app for the LLM and
video routes). Importing this package imports nothing heavy.
"""

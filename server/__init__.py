"""kiln.server: ``kiln serve``, the KServe/Triton V2 HTTP server (app.py) with dynamic batching (batcher.py),
CPU worker processes and GPU workers (workers.py, gpu.py), metrics, a model repository, and deployment to
Ray Serve and KServe (ray_serve.py, deploy.py). See docs/ARCHITECTURE.md."""

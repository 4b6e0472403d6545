"""Prometheus series of the video queue, read from the job store at every scrape (so they count the jobs of every
worker process and survive restarts):

| name | kind | meaning |
|---|---|---|
| ``metainfer:video_jobs_waiting`` | gauge | jobs queued (the queue depth) |
| ``metainfer:video_jobs_running`` | gauge | jobs a worker is rendering |
| ``metainfer:video_jobs_finished`` | gauge | jobs in the store by final ``status`` (completed, failed, cancelled) |
| ``metainfer:video_workers_alive`` | gauge | worker processes running |
| ``metainfer:video_clip_seconds`` | histogram | render time of each completed clip, claim to clip on disk |

Every series carries ``model_name``, as the LLM's ``vllm:*`` series do.
"""

from __future__ import annotations

import bisect

from metainfer_gen.serve.video.jobs import JobStatus

CLIP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class VideoCollector:
    """A prometheus-client custom collector over a :class:`~.service.VideoService`; register it with
    ``registry.register(VideoCollector(service))``."""

    def __init__(self, service):
        self.service = service

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        name = self.service.model_name
        counts = self.service.store.counts()
        for metric, doc, value in (
                ("metainfer:video_jobs_waiting", "Video jobs queued.", counts[JobStatus.QUEUED]),
                ("metainfer:video_jobs_running", "Video jobs being rendered.", counts[JobStatus.IN_PROGRESS]),
                ("metainfer:video_workers_alive", "Video worker processes running.",
                 self.service.num_alive_workers)):
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        finished = GaugeMetricFamily("metainfer:video_jobs_finished", "Finished video jobs in the store.",
                                     labels=["model_name", "status"])
        for status in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED):
            finished.add_metric([name, status.value], counts[status])
        yield finished
        seconds = sorted(self.service.store.render_seconds())
        buckets = [(f"{edge:g}", bisect.bisect_right(seconds, edge)) for edge in CLIP_BUCKETS]
        buckets.append(("+Inf", len(seconds)))
        histogram = HistogramMetricFamily("metainfer:video_clip_seconds", "Render time of completed clips.",
                                          labels=["model_name"])
        histogram.add_metric([name], buckets, sum(seconds))
        yield histogram

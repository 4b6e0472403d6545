"""Text-to-video: ``TextToVideoPipeline.from_pretrained()(prompt)`` on any diffusers video pipeline."""

from __future__ import annotations

from typing import Any

from metainfer_gen.pipelines.loading import TEXT_TO_VIDEO
from metainfer_gen.pipelines.negative_prompt import used_negative_prompt
from metainfer_gen.pipelines.video_base import VideoPipelineBase
from metainfer_gen.video.output import FramesOutput, VideoOutput


class TextToVideoPipeline(VideoPipelineBase):
    """Render clips from text prompts.

    Wraps a diffusers text-to-video pipeline (Wan 2.1/2.2, HunyuanVideo, CogVideoX, LTX-Video, or the embedded
    default Wan model). Example::

        from metainfer_gen import pipelines
        pipe = pipelines.TextToVideoPipeline.from_pretrained()
        out = pipe("a red circle moving right", seed=0)
        out.frames.shape  # (17, 64, 64, 3) uint8
        out.save("clip.mp4")
    """

    task = TEXT_TO_VIDEO

    def __call__(
        self,
        prompt: str | list[str],
        *,
        negative_prompt: str | list[str] | None = None,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
        generator=None,
        num_videos_per_prompt: int = 1,
        output_type: str | None = None,
        **kwargs: Any,
    ) -> VideoOutput | list[VideoOutput] | FramesOutput:
        """Generate ``num_videos_per_prompt`` clips per prompt.

        Args:
            prompt: text, or a list for a batch.
            negative_prompt: what to steer away from. Used only when ``guidance_scale > 1``; otherwise ignored
                with a ``UserWarning`` and recorded as None in ``settings``.
            num_frames: frames to render; must fit the family's rule (``k*4+1`` for Wan).
            height, width: pixels; multiples of the family's spatial grid (16 for Wan).
            num_inference_steps: denoising steps. guidance_scale: classifier-free guidance weight (1 disables).
            seed: integer seed (a CPU ``torch.Generator``); or pass ``generator`` directly.
            num_videos_per_prompt: clips per prompt, each rendered with its own seed (``seed``, ``seed + 1``, ...;
                drawn from ``generator`` when one is given, at random otherwise; each clip's ``settings["seed"]``
                says which), so clip i equals a single call with that seed; each has its own stats.
            output_type: None (ours: uint8 frames, ``save()``), or diffusers' ``"np"``, ``"pil"``, ``"pt"``,
                ``"latent"`` (a :class:`~metainfer_gen.video.output.FramesOutput` in diffusers' layout, so
                ``export_to_video(out.frames[0], "clip.mp4")`` works as in diffusers' docs).
            kwargs: forwarded to the diffusers pipeline (e.g. ``max_sequence_length``, ``callback_on_step_end``).
        Returns:
            A :class:`VideoOutput` for a string prompt and one video, else a list of them (prompt-major); a
            ``FramesOutput`` for a diffusers ``output_type``.
        Raises:
            ValueError / TypeError: invalid arguments, before any computation.
        """
        values = self.resolve(prompt=prompt, num_frames=num_frames, height=height, width=width,
                              num_inference_steps=num_inference_steps, guidance_scale=guidance_scale)
        negative_prompt = used_negative_prompt(self.diffusers_pipeline, negative_prompt, values["guidance_scale"],
                                               kwargs)
        settings = {"task": self.task, "prompt": prompt, "negative_prompt": negative_prompt, "seed": seed, **values}
        outputs = self._run({"prompt": prompt, "negative_prompt": negative_prompt, **values, **kwargs},
                            settings, seed, generator, num_videos_per_prompt=num_videos_per_prompt,
                            output_type=output_type)
        single = isinstance(prompt, str) and num_videos_per_prompt == 1 and output_type is None
        return outputs[0] if single else outputs

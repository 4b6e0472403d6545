"""Reference-image-to-video: animate a given first frame as the prompt says."""

from __future__ import annotations

from typing import Any

from metainfer_gen.pipelines.loading import IMAGE_TO_VIDEO
from metainfer_gen.pipelines.negative_prompt import used_negative_prompt
from metainfer_gen.pipelines.video_base import VideoPipelineBase
from metainfer_gen.video.images import fit_image, load_image
from metainfer_gen.video.output import FramesOutput, VideoOutput


class ImageToVideoPipeline(VideoPipelineBase):
    """Render clips that start from a reference image.

    Wraps a diffusers image-to-video pipeline (Wan 2.1 I2V with or without a CLIP image encoder, Wan 2.2
    TI2V-style models, CogVideoX/LTX/Hunyuan I2V) or the embedded default. The image may be any PIL mode or size:
    it is converted to RGB (alpha composited on white; 16-bit and float grayscale scaled to 8 bits, see
    ``video.images.to_8_bit``), centre-cropped to the output aspect ratio and resized.
    Example::

        i2v = pipelines.ImageToVideoPipeline.from_pretrained()
        out = i2v("photo.png", "the red circle moves up", seed=0)
    """

    task = IMAGE_TO_VIDEO

    def __call__(
        self,
        image: Any,
        prompt: str,
        *,
        negative_prompt: str | None = None,
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
        """Generate ``num_videos_per_prompt`` clips whose first frame is ``image``.

        Args:
            image: path, ``PIL.Image`` or uint8 array (H, W[, C]).
            prompt: text describing the motion. Other arguments as in :class:`TextToVideoPipeline` (a
                ``negative_prompt`` at ``guidance_scale <= 1`` is ignored with a warning and recorded as None;
                ``num_videos_per_prompt`` and ``output_type`` too).
        Returns:
            A :class:`VideoOutput` (a list for several videos; a ``FramesOutput`` for a diffusers
            ``output_type``); ``settings["image_size"]`` is the (width, height) the image was fitted to.
        Raises:
            ValueError / TypeError / FileNotFoundError: bad arguments or image, before any computation.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be one string for image-to-video; got {type(prompt).__name__}")
        values = self.resolve(prompt=prompt, num_frames=num_frames, height=height, width=width,
                              num_inference_steps=num_inference_steps, guidance_scale=guidance_scale)
        picture = fit_image(load_image(image), values["height"], values["width"])
        negative_prompt = used_negative_prompt(self.diffusers_pipeline, negative_prompt, values["guidance_scale"],
                                               kwargs)
        settings = {"task": self.task, "prompt": prompt, "negative_prompt": negative_prompt, "seed": seed,
                    "image_size": list(picture.size), **values}
        call = {"image": picture, "prompt": prompt, "negative_prompt": negative_prompt, **values, **kwargs}
        outputs = self._run(call, settings, seed, generator, num_videos_per_prompt=num_videos_per_prompt,
                            output_type=output_type)
        return outputs[0] if num_videos_per_prompt == 1 and output_type is None else outputs

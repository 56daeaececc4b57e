"""Encoded video (an mp4, webm, mkv... file's bytes) -> its frames and their metadata, with PyAV (FFmpeg).

Every frame is decoded, as transformers' own pyav loader does, so the model's video processor samples them at its
fps exactly as transformers would from the file. A video longer than the frame budget (MAX_VIDEO_FRAMES, and
MAX_DECODED_BYTES of RGB) keeps frames spread evenly over it, with its fps scaled to match: the timestamps stay
true and the processor samples from what was kept. Every refusal is a ValueError that names the video.
"""

from __future__ import annotations

import io

import numpy as np

from jaxpaged.utils.extras import MissingExtraError, require

MAX_VIDEO_FRAMES = 1024
MAX_DECODED_BYTES = 2 * 1024**3  # the kept frames in RGB


def _pyav(what: str):
    """PyAV, or a ValueError (a request's problem on the server: a 400 that names the extra, not a 500)."""
    try:
        return require("av", "decoding video files")
    except MissingExtraError as exc:
        raise ValueError(f"{what}: {exc}") from None


def decode_video(data: bytes, what: str, max_pixels: int, max_frames: int = MAX_VIDEO_FRAMES,
                 max_decoded_bytes: int = MAX_DECODED_BYTES) -> tuple[np.ndarray, dict]:  # fmt: skip
    """(frames [T, H, W, 3] uint8, metadata {"fps", "total_num_frames", "duration", "width", "height",
    "video_backend"}) of the first video stream in `data`."""
    av = _pyav(what)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError(f"{what}: the file holds no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width < 1 or height < 1 or width * height > max_pixels:
                raise ValueError(f"{what}: frames of {width}x{height} pixels (at most {max_pixels}, at least 1)")
            rate = stream.average_rate or stream.guessed_rate
            if not rate or rate <= 0:
                raise ValueError(f"{what}: the video states no frame rate")
            total = stream.frames or _count_frames(container, stream)
            if total < 1:
                raise ValueError(f"{what}: the video has no frames")
            keep = min(total, max_frames, max(1, max_decoded_bytes // (width * height * 3)))
            wanted = None if keep == total else set(np.linspace(0, total - 1, keep).round().astype(int).tolist())
            stream.thread_type = "AUTO"
            frames = []
            for i, frame in enumerate(container.decode(stream)):
                if wanted is None or i in wanted:
                    frames.append(frame.to_ndarray(format="rgb24", width=width, height=height))
                    if len(frames) > keep:
                        raise ValueError(f"{what}: the video has more frames than it states ({total})")
    except (av.FFmpegError, OSError, EOFError) as exc:  # not a container FFmpeg knows, a truncated or corrupt file
        raise ValueError(f"{what}: not a readable video: {exc}") from None
    if not frames:
        raise ValueError(f"{what}: no frame could be decoded")
    fps = float(rate) if wanted is None else float(rate) * len(frames) / total  # the kept frames span the whole video
    return np.stack(frames), {"fps": fps, "total_num_frames": len(frames), "duration": total / float(rate),
                              "width": width, "height": height, "video_backend": "pyav"}  # fmt: skip


def _count_frames(container, stream) -> int:
    """The frames of a container that does not state their number (webm, some mkv): its packets, then back to the start."""
    count = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0)
    return count

"""Images and videos from what a request sends: PIL images (a video's frames), bytes, `data:` URLs, local files
under one allowed folder, and http(s) URLs of allowed hosts only (off by default), with size and time limits. Every
refusal is a ValueError that names the problem (the server answers 400 with it)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from jaxpaged.multimodal.video import MAX_VIDEO_FRAMES, decode_video

DEFAULT_MAX_BYTES = 20 * 1024 * 1024  # an image's encoded size, from any source
DEFAULT_MAX_VIDEO_BYTES = 256 * 1024 * 1024  # a video file's
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024  # decoded (Pillow's decompression-bomb guard is 89M)
DEFAULT_TIMEOUT_S = 10.0


def encoded(source) -> bool:
    """Whether a media source is a file still to read and decode (bytes, or a URL or path naming one, OpenAI's
    {"url": ...} too) rather than an image or a video's frames."""
    return isinstance(source, (str, bytes, bytearray, memoryview, dict))


def _pil():
    try:
        from PIL import Image
    except ImportError as exc:  # pillow is in the vision extra
        raise ImportError("images need Pillow: pip install 'jaxpaged[vision]'") from exc
    return Image


@dataclasses.dataclass
class MediaLoader:
    allowed_local_media_path: str | None = None  # files only under this folder; None: no local files
    allowed_media_domains: tuple[str, ...] = ()  # http(s) hosts images may be fetched from; empty: none
    max_bytes: int = DEFAULT_MAX_BYTES
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    timeout_s: float = DEFAULT_TIMEOUT_S

    def load(self, source, what: str = "image"):
        """A PIL image in RGB from a PIL image, bytes, a data: URL, a file path (or file:// URL) or an http(s) URL."""
        Image = _pil()
        if isinstance(source, Image.Image):
            return self._checked(source, what)
        return self._decode(self._encoded(source, what, "image"), what)

    def _encoded(self, source, what: str, kind: str) -> bytes:
        """The file's bytes, from bytes, a data: URL, a file path (or file:// URL) or an http(s) URL."""
        if isinstance(source, (bytes, bytearray, memoryview)):
            return self._sized(bytes(source), what, kind)
        if isinstance(source, dict):  # OpenAI's {"url": ...}
            source = source.get("url")
        if not isinstance(source, str) or not source:
            given = "a PIL image, " if kind == "image" else "its frames, "
            raise ValueError(f"{what}: expected an {kind} ({given}bytes, or a data:, file or http(s) URL), got "
                             f"{type(source).__name__}")  # fmt: skip
        scheme = urllib.parse.urlsplit(source).scheme.lower()
        if scheme == "data":
            return self._data_url(source, what, kind)
        if scheme in ("http", "https"):
            return self._fetch(source, what, kind)
        if scheme == "file" or scheme == "" or (len(scheme) == 1 and os.name == "nt"):
            return self._local(source, what, kind)
        raise ValueError(f"{what}: URL scheme {scheme!r} is not supported (data:, file or http(s))")

    def _limit(self, kind: str) -> int:
        return self.max_video_bytes if kind == "video" else self.max_bytes

    def _sized(self, data: bytes, what: str, kind: str) -> bytes:
        if len(data) > self._limit(kind):
            raise ValueError(f"{what}: the {kind} is larger than {self._limit(kind)} bytes")
        return data

    def load_video(self, source, what: str = "video") -> tuple[np.ndarray, dict | None]:
        """(frames [T, H, W, 3] uint8, metadata or None) from frames: an array, a list of PIL images or arrays, or
        (frames, {"fps": ..., ...}) as vLLM takes a video with its metadata (the processor's frame timestamps read
        fps; without it transformers assumes 24); or from an encoded video (bytes, a data:, file or http(s) URL),
        decoded with its metadata (multimodal/video.py)."""
        if encoded(source):
            return decode_video(self._encoded(source, what, "video"), what, self.max_pixels)
        metadata = None
        if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], dict):
            source, metadata = source
            fps = metadata.get("fps")
            if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
                raise ValueError(f"{what}: its metadata's fps must be a positive number (got {fps!r})")
        if isinstance(source, (list, tuple)):
            Image = _pil()
            source = [np.asarray(self._checked(f, what) if isinstance(f, Image.Image) else f) for f in source]
            if not source or len({f.shape for f in source}) != 1:
                raise ValueError(f"{what}: the frames must be one or more images of one size")
            source = np.stack(source)
        frames = np.asarray(source)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or 0 in frames.shape:
            raise ValueError(f"{what}: expected frames [T, H, W, 3] of uint8 (got {frames.dtype} {frames.shape})")
        if frames.shape[0] > MAX_VIDEO_FRAMES or frames.shape[1] * frames.shape[2] > self.max_pixels:
            raise ValueError(f"{what}: at most {MAX_VIDEO_FRAMES} frames of {self.max_pixels} pixels (got {frames.shape[:3]})")
        return frames, metadata

    def _data_url(self, url: str, what: str, kind: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.lower().startswith(f"data:{kind}/"):
            raise ValueError(f"{what}: a data URL must be data:{kind}/<type>;base64,<data>")
        if ";base64" not in header.lower():
            raise ValueError(f"{what}: only base64 data URLs are supported")
        if len(payload) > self._limit(kind) * 4 // 3 + 4:
            raise ValueError(f"{what}: the {kind} is larger than {self._limit(kind)} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{what}: the data URL's base64 is corrupt: {exc}") from None

    def _local(self, source: str, what: str, kind: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise ValueError(f"{what}: local files are not allowed (start with --allowed-local-media-path to allow a folder)")
        path = urllib.parse.unquote(urllib.parse.urlsplit(source).path) if source.startswith("file:") else source
        root = Path(self.allowed_local_media_path).resolve()
        target = Path(path).resolve()
        if root != target and root not in target.parents:
            raise ValueError(f"{what}: {path} is outside the allowed media folder")
        if not target.is_file():
            raise ValueError(f"{what}: {path} is not a file")
        if target.stat().st_size > self._limit(kind):
            raise ValueError(f"{what}: the {kind} is larger than {self._limit(kind)} bytes")
        return target.read_bytes()

    def _fetch(self, url: str, what: str, kind: str) -> bytes:
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if not self.allowed_media_domains or host not in {d.lower() for d in self.allowed_media_domains}:
            raise ValueError(f"{what}: fetching media from {host or url!r} is not allowed (--allowed-media-domains)")
        allowed = {d.lower() for d in self.allowed_media_domains}

        class SameHosts(urllib.request.HTTPRedirectHandler):
            """A redirect may not leave the allowed hosts."""

            def redirect_request(self, req, fp, code, msg, headers, newurl):
                if (urllib.parse.urlsplit(newurl).hostname or "").lower() not in allowed:
                    raise ValueError(f"{what}: {url} redirects to a host that is not allowed")
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        request = urllib.request.Request(url, headers={"User-Agent": "jaxpaged"})
        try:
            with urllib.request.build_opener(SameHosts).open(request, timeout=self.timeout_s) as response:
                data = response.read(self._limit(kind) + 1)
        except OSError as exc:
            raise ValueError(f"{what}: could not fetch {url}: {exc}") from None
        return self._sized(data, what, kind)

    def _decode(self, data: bytes, what: str):
        Image = _pil()
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > self.max_pixels:
                raise ValueError(f"{what}: the image has {width}x{height} pixels, more than {self.max_pixels}")
            image.load()
        except ValueError:
            raise
        except Exception as exc:  # Pillow's UnidentifiedImageError, truncated files, decompression bombs
            raise ValueError(f"{what}: not a readable image: {exc}") from None
        return self._checked(image, what)

    def _checked(self, image, what: str):
        width, height = image.size
        if width < 1 or height < 1:
            raise ValueError(f"{what}: the image is empty ({width}x{height})")
        if width * height > self.max_pixels:
            raise ValueError(f"{what}: the image has {width}x{height} pixels, more than {self.max_pixels}")
        return image if image.mode == "RGB" else image.convert("RGB")

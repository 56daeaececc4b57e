"""Video files decoded with PyAV (jaxpaged/multimodal/video.py) from bytes, data: URLs and allowed local files: the
frames and metadata transformers' own pyav loader reads from the same file (mp4, a lossless mkv that gives back the
frames encoded, a webm that states no frame count); a video over the frame budget keeps frames spread evenly with
its fps scaled so that its timestamps hold; bad files and sources are ValueErrors naming the video."""

from __future__ import annotations

import base64
import sys
import wave

import numpy as np
import pytest

av = pytest.importorskip("av")

from jaxpaged.multimodal.media import MediaLoader  # noqa: E402
from jaxpaged.multimodal.video import decode_video  # noqa: E402
from tests.vlm_models import write_video as encode  # noqa: E402

FPS = 6


def frames(count: int = 10, height: int = 32, width: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize(("name", "codec", "pix_fmt"), [("a.mp4", "mpeg4", "yuv420p"), ("a.mkv", "ffv1", "bgr0"),
                                                        ("a.webm", "libvpx-vp9", "yuv420p")])  # fmt: skip
def test_frames_and_metadata_equal_transformers_pyav_loader(tmp_path, name, codec, pix_fmt):
    from transformers.video_utils import load_video

    given = frames()
    data = encode(tmp_path / name, given, codec, pix_fmt)
    got, meta = decode_video(data, "video", max_pixels=10**6)
    assert got.shape == given.shape and meta["fps"] == FPS and meta["total_num_frames"] == 10
    assert meta["duration"] == pytest.approx(10 / FPS) and (meta["width"], meta["height"]) == (48, 32)
    if name.endswith(".mp4"):  # mkv and webm state no frame count: transformers' loader reads none of their frames
        want, want_meta = load_video(str(tmp_path / name), backend="pyav")
        np.testing.assert_array_equal(got, want)
        assert (meta["total_num_frames"], meta["fps"]) == (want_meta.total_num_frames, want_meta.fps)
    if codec == "ffv1":  # lossless in RGB: the frames encoded come back
        np.testing.assert_array_equal(got, given)


def test_bytes_data_urls_and_allowed_files_give_the_same_video(tmp_path):
    data = encode(tmp_path / "a.mkv", frames(), "ffv1", "bgr0")
    loader = MediaLoader(allowed_local_media_path=str(tmp_path))
    url = "data:video/x-matroska;base64," + base64.b64encode(data).decode()
    results = [loader.load_video(s) for s in (data, url, {"url": url}, str(tmp_path / "a.mkv"), (tmp_path / "a.mkv").as_uri())]
    for got, meta in results:
        np.testing.assert_array_equal(got, results[0][0])
        assert meta == results[0][1]


def test_a_video_over_the_budget_keeps_frames_spread_over_it(tmp_path):
    given = frames(count=11)
    data = encode(tmp_path / "a.mkv", given, "ffv1", "bgr0")
    got, meta = decode_video(data, "video", max_pixels=10**6, max_frames=5)
    np.testing.assert_array_equal(got, given[[0, 2, 5, 8, 10]])  # linspace(0, 10, 5), rounded
    assert meta["total_num_frames"] == 5 and meta["fps"] == pytest.approx(FPS * 5 / 11)
    assert meta["duration"] == pytest.approx(11 / FPS)  # the kept frames still span the video
    got, meta = decode_video(data, "video", max_pixels=10**6, max_decoded_bytes=3 * 32 * 48 * 3)
    assert len(got) == meta["total_num_frames"] == 3  # the decoded-bytes budget binds the same way


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        (b"not a video at all", "not a readable video"),
        ("data:image/png;base64,AAAA", "data:video/"),
        ("data:video/mp4;base64,!!", "base64"),
        ("file:///etc/hostname", "outside the allowed media folder"),
        ("https://example.com/a.mp4", "not allowed"),
        (3, "expected frames"),
    ],
)
def test_bad_videos_are_value_errors_naming_them(tmp_path, source, problem):
    loader = MediaLoader(allowed_local_media_path=str(tmp_path))
    with pytest.raises(ValueError, match=problem) as info:
        loader.load_video(source, what="messages[0].content[1]")
    assert str(info.value).startswith("messages[0].content[1]: ")


def test_limits_on_bytes_and_pixels(tmp_path):
    data = encode(tmp_path / "a.mkv", frames(), "ffv1", "bgr0")
    with pytest.raises(ValueError, match="larger than 100 bytes"):
        MediaLoader(max_video_bytes=100).load_video(data)
    with pytest.raises(ValueError, match="48x32 pixels"):
        MediaLoader(max_pixels=1000).load_video(data)
    audio = tmp_path / "a.wav"
    with wave.open(str(audio), "wb") as sound:
        sound.setnchannels(1), sound.setsampwidth(2), sound.setframerate(8000)
        sound.writeframes(bytes(1600))
    with pytest.raises(ValueError, match="no video stream"):
        MediaLoader().load_video(audio.read_bytes())


def test_without_pyav_a_video_file_is_a_value_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # importing it now fails as if it were not installed
    with pytest.raises(ValueError, match=r"video\[0\]: decoding video files needs the av package.*jaxpaged\[video\]"):
        MediaLoader().load_video(b"\x00" * 64, what="video[0]")

import numpy as np
import pytest

from adaptiveload.tokens import latent_shape, token_count


@pytest.mark.parametrize(
    ("frames", "height", "width", "tokens"),
    [(81, 480, 832, 32_760), (81, 720, 1280, 75_600), (1, 480, 832, 1_560), (1, 1024, 1024, 4_096)],
)
def test_pinned_wan_token_counts(frames, height, width, tokens):
    assert token_count(frames, height, width) == tokens


def test_vectorised_matches_scalar():
    f = np.array([1, 17, 81])
    h = np.array([480, 720, 256])
    w = np.array([832, 1280, 256])
    expected = [token_count(int(a), int(b), int(c)) for a, b, c in zip(f, h, w, strict=True)]
    assert token_count(f, h, w).tolist() == expected


def test_latent_shape():
    assert latent_shape(81, 480, 832) == (21, 60, 104)

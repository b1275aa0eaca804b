"""pfp1 on the host through the server's native library (gpu_server/native/fingerprint.cpp),
against the NumPy rendering and the word-at-a-time reference (snapshot/fingerprint.py)."""
import os

import numpy as np
import pytest

from conftest import ROOT
from phos.base import native
from phos.snapshot import fingerprint as pfp1


@pytest.fixture(autouse=True)
def built():
    if native.library(os.path.join(ROOT, "phos", "stub", native.LIBRARY)) is None:
        pytest.fail("phos/stub/libphos_server.so is not built: make -C client_stub/native")
    assert pfp1._native() is not None, "fingerprint() does not use the native library"


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 64, 65, 4352, 65536 + 3, 2 << 20])
def test_native_lane_sums_equal_numpys(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    view = pfp1._as_bytes_view(data)
    assert pfp1.native_lane_sums(view) == pfp1._lane_sums(pfp1._words(view))


def test_fingerprints_keep_their_known_answers_and_the_reference():
    assert pfp1.fingerprint(b"").hex() == "3338822534e18f2973c2cd5f9cdfc9dd"
    assert pfp1.fingerprint(bytes(range(256)) * 17).hex() == "b3ec6b17740d8ce79967b02b3c9e55e3"
    odd = np.random.default_rng(5).integers(0, 256, 1001, dtype=np.uint8)
    assert pfp1.fingerprint(odd) == pfp1.reference_fingerprint(odd.tobytes())
    # a view into the middle of a buffer, not at its start
    assert pfp1.fingerprint(memoryview(odd.tobytes())[3:803]) == pfp1.reference_fingerprint(odd.tobytes()[3:803])


def test_a_changed_word_changes_the_fingerprint():
    data = bytearray(np.random.default_rng(9).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes())
    before = pfp1.fingerprint(data)
    data[12345] ^= 1
    assert pfp1.fingerprint(data) != before

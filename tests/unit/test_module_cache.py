"""The server's module images by digest (gpu_server/worker/module_cache.py): kept once their digest
is checked, checked again when read, bounded by size."""
import os

from phos.gpu_server.worker.module_cache import ModuleCache, image_digest


def test_an_image_is_kept_and_found_by_its_digest(tmp_path):
    cache = ModuleCache(str(tmp_path), 1 << 20)
    image = b"\x7fELF" + os.urandom(1000)
    assert cache.get(image_digest(image)) is None
    assert cache.put(image_digest(image), image)
    assert cache.get(image_digest(image)) == image
    assert oct(os.stat(tmp_path / image_digest(image).hex()).st_mode & 0o777) == "0o600"


def test_a_changed_or_replaced_file_is_a_miss_never_a_wrong_image(tmp_path):
    cache = ModuleCache(str(tmp_path), 1 << 20)
    image = os.urandom(4096)
    digest = image_digest(image)
    cache.put(digest, image)
    path = tmp_path / digest.hex()
    path.write_bytes(image[:-1] + b"!")                    # changed on disk
    assert cache.get(digest) is None and not path.exists()
    (tmp_path / "elsewhere").write_bytes(image)
    path.symlink_to(tmp_path / "elsewhere")               # a link in its place
    assert cache.get(digest) is None
    assert cache.get(b"short") is None


def test_the_images_used_longest_ago_go_first(tmp_path):
    cache = ModuleCache(str(tmp_path), 13_000)       # room for three of them
    images = [bytes([i]) * 4000 for i in range(3)]
    for n, image in enumerate(images):
        cache.put(image_digest(image), image)
        os.utime(tmp_path / image_digest(image).hex(), (1000 + n, 1000 + n))
    assert cache.get(image_digest(images[0])) == images[0]   # used now: kept
    assert cache.put(image_digest(b"x" * 4000), b"x" * 4000)
    kept = {image for image in images + [b"x" * 4000] if cache.get(image_digest(image))}
    assert kept == {images[0], images[2], b"x" * 4000}
    assert not cache.put(image_digest(b"y" * 20_000), b"y" * 20_000)     # bigger than the whole cache


def test_a_tenant_sees_only_the_images_it_sent_and_the_bound_is_the_servers(tmp_path):
    """Whether a digest is a hit told a tenant whether anyone had loaded that module."""
    cache = ModuleCache(str(tmp_path), 10_000)
    a, b = cache.view("a" * 64), cache.view("b" * 64)
    image = os.urandom(4000)
    assert a.put(image_digest(image), image)
    assert a.get(image_digest(image)) == image
    assert b.get(image_digest(image)) is None and cache.get(image_digest(image)) is None
    assert b.put(image_digest(image), image) and b.get(image_digest(image)) == image
    assert b.put(image_digest(b"y" * 4000), b"y" * 4000)     # three of 4000 bytes: past the server's 10,000
    held = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert held <= 10_000

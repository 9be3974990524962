import numpy as np

from models import ByteTokenizer, data


def _fake_stdlib(tmp_path):
    for i in range(60):
        sub = tmp_path / ("pkg" if i % 2 else "") / ("test" if i % 7 == 0 else "")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third.py").write_text("y = 1\n")
    return tmp_path


def test_files_sorted_without_tests_or_site_packages(tmp_path):
    root = _fake_stdlib(tmp_path)
    files = [p.relative_to(root).as_posix() for p in data.stdlib_files(str(root))]
    assert files == sorted(files)
    assert not any("test" in f.split("/") or "site-packages" in f for f in files)
    assert len(files) == 60 - len([i for i in range(60) if i % 7 == 0])


def test_split_is_deterministic_and_disjoint(tmp_path):
    root = _fake_stdlib(tmp_path)
    a = data.Corpus.from_stdlib(str(root))
    b = data.Corpus.from_stdlib(str(root))
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.heldout, b.heldout)
    tok = ByteTokenizer()
    docs = tok.decode(a.train).count("x = ") + tok.decode(a.heldout).count("x = ")
    assert docs == len(data.stdlib_files(str(root)))
    assert a.train[0] == tok.bos_id and a.train[-1] == tok.eos_id


def test_real_stdlib_split_fraction():
    files = data.stdlib_files()
    assert len(files) > 100
    held = [data.is_heldout(p.name) for p in files]
    assert 0.01 < np.mean(held) < 0.15


def test_windows_segments_and_weights():
    tok = ByteTokenizer()
    stream = np.array([tok.bos_id, 1, 2, tok.eos_id, tok.bos_id, 3, 4, 5, tok.eos_id], np.uint16)
    inputs, targets, seg, weights = data.windows(stream, np.array([1]), 6)
    np.testing.assert_array_equal(inputs, [[1, 2, tok.eos_id, tok.bos_id, 3, 4]])
    np.testing.assert_array_equal(targets, [[2, tok.eos_id, tok.bos_id, 3, 4, 5]])
    np.testing.assert_array_equal(seg, [[0, 0, 0, 1, 1, 1]])
    # The EOS -> next BOS target crosses a document boundary and carries no weight.
    np.testing.assert_array_equal(weights, [[1, 1, 0, 1, 1, 1]])


def test_heldout_batches_are_fixed():
    stream = np.arange(1000, dtype=np.uint16) % 256
    a = data.heldout_batches(stream, 2, 16, 3)
    b = data.heldout_batches(stream, 2, 16, 3)
    assert len(a) == 3 and a[0][0].shape == (2, 16)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x[0], y[0])

"""Data modules: the CIFAR-10 reader on files in the real format, digits, text, synthetic data."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from commsched import CommSchedConfigError
from commsched.data import ByteTextData, Cifar10Data, DigitsData, SyntheticImages, SyntheticTokens


def write_cifar10(directory, per_file: int = 10) -> dict[str, tuple[bytes, list[int]]]:
    """Write data_batch_1..5 and test_batch exactly as CIFAR-10's python pickles are laid out."""
    written = {}
    g = torch.Generator().manual_seed(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = torch.randint(0, 256, (per_file, 3072), generator=g, dtype=torch.uint8).numpy()
        labels = torch.randint(0, 10, (per_file,), generator=g).tolist()
        with open(directory / name, "wb") as handle:
            pickle.dump({b"batch_label": name.encode(), b"data": data, b"labels": labels, b"filenames": []}, handle)
        written[name] = (data, labels)
    return written


def test_cifar10_reader_reads_the_pickle_format(tmp_path):
    written = write_cifar10(tmp_path)
    data = Cifar10Data(dir=str(tmp_path), batch_size=4, augment=False)
    data.setup("fit")
    assert len(data.train_set) == 50 and len(data.val_set) == 10
    first_pixels, first_labels = written["data_batch_1"]
    assert torch.equal(data.train_set.images[0].reshape(-1), torch.as_tensor(first_pixels[0]))
    assert data.train_set.labels[:10].tolist() == first_labels
    image, label = data.train_set[3]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (4, 3, 32, 32) and labels.shape == (4,)


def test_cifar10_augmentation_keeps_shape(tmp_path):
    write_cifar10(tmp_path)
    data = Cifar10Data(dir=str(tmp_path), augment=True)
    data.setup("fit")
    assert data.train_set[0][0].shape == (3, 32, 32)


def test_cifar10_missing_dir_says_what_to_place_there(tmp_path):
    with pytest.raises(CommSchedConfigError, match="data_batch_1 .. data_batch_5 and test_batch"):
        Cifar10Data(dir=str(tmp_path / "nowhere"))


def test_digits_split_is_fixed_and_resized():
    a, b = DigitsData(resolution=32, seed=3), DigitsData(resolution=32, seed=3)
    a.setup("fit")
    b.setup("fit")
    assert len(a.train_set) + len(a.val_set) == 1797
    assert torch.equal(a.val_set.tensors[1], b.val_set.tensors[1])
    assert a.train_set[0][0].shape == (3, 32, 32)


def test_text_from_default_corpus_and_from_a_directory(tmp_path):
    default = ByteTextData(block_size=32)
    default.setup("fit")
    assert len(default.train_set) > 1000  # Python's documentation topics: real text on every machine
    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "b.md").write_text("second file " * 20)
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 100)
    data = ByteTextData(path=str(tmp_path), block_size=8, val_fraction=0.25)
    data.setup("fit")
    inputs, targets = data.train_set[0]
    assert inputs.tolist() == list(b"hello wo") and targets.tolist() == list(b"ello wor")
    with pytest.raises(CommSchedConfigError, match="neither a file nor a directory"):
        ByteTextData(path=str(tmp_path / "missing")).setup("fit")


def test_synthetic_samples_are_deterministic():
    assert torch.equal(SyntheticImages(4, seed=1)[2][0], SyntheticImages(4, seed=1)[2][0])
    inputs, targets = SyntheticTokens(4, block_size=8)[1]
    assert torch.equal(inputs[1:], targets[:-1])


# ----------------------------------------------------------------- data caching
class NpyFiles(torch.utils.data.Dataset):
    """A map-style dataset that reads (and 'decodes') one file per sample, as image folders do."""

    def __init__(self, root):
        self.files = sorted(Path(root).glob("*.npy"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        import numpy as np

        return torch.from_numpy(np.load(self.files[index])).float() / 255.0


def write_samples(root: Path, n: int = 12) -> None:
    import numpy as np

    root.mkdir(parents=True)
    for i in range(n):
        np.save(root / f"{i:03d}.npy", np.full((3, 4, 4), i, dtype=np.uint8))


def test_cached_samples_are_read_once_and_survive_the_files(tmp_path):
    from commsched.data.cache import CachedDataset

    write_samples(tmp_path / "slow")
    cached = CachedDataset(NpyFiles(tmp_path / "slow"))
    first = [cached[i] for i in range(len(cached))]
    shutil.rmtree(tmp_path / "slow")  # the second epoch reads nothing from disk
    loader = torch.utils.data.DataLoader(cached, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    second = torch.cat([batch for batch in loader])
    assert sorted(float(x[0, 0, 0]) for x in second) == sorted(float(x[0, 0, 0]) for x in first)
    assert (cached.misses, cached.hits) == (12, 12)


def test_two_folders_of_the_same_name_get_copies_of_their_own(tmp_path):
    from commsched.data.cache import local_copy

    for run in ("a", "b"):
        (tmp_path / run / "data").mkdir(parents=True)
        (tmp_path / run / "data" / "which.txt").write_text(run)
    copies = [local_copy(tmp_path / run / "data", tmp_path / "cache") for run in ("a", "b")]
    assert copies[0] != copies[1]
    assert [(copy / "which.txt").read_text() for copy in copies] == ["a", "b"]


def test_local_copy_copies_once_even_when_ranks_ask_together(tmp_path):
    import multiprocessing

    from commsched.data.cache import local_copy

    write_samples(tmp_path / "slow")
    context = multiprocessing.get_context("spawn")
    with context.Pool(3) as pool:
        targets = pool.starmap(local_copy, [(tmp_path / "slow", tmp_path / "cache")] * 3)
    assert len(set(targets)) == 1 and sorted(p.name for p in Path(targets[0]).iterdir()) == [
        f"{i:03d}.npy" for i in range(12)
    ]
    copied = Path(targets[0]).stat().st_ino
    assert local_copy(tmp_path / "slow", tmp_path / "cache").stat().st_ino == copied  # unchanged: not copied again
    (tmp_path / "slow" / "000.npy").unlink()  # changed: a later run copies it again
    refreshed = local_copy(tmp_path / "slow", tmp_path / "cache")
    assert refreshed == Path(targets[0]) and not (refreshed / "000.npy").exists()
    assert not [p for p in (tmp_path / "cache").iterdir() if "partial" in p.name or "stale" in p.name]
    with pytest.raises(Exception, match="local_copy.source"):
        local_copy(tmp_path / "missing", tmp_path / "cache")

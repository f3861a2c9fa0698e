"""Manifests: one row per sample (CSV or Parquet), validated column-wise before anything uses it.

Columns: ``sample_id`` (unique string), ``num_frames`` (>= 1; 1 is an image), ``height``,
``width`` (pixels) are required; ``fps``, ``path``, ``caption``, ``latent_path`` are optional
and always present in the returned frame (null where absent); a latent cache's other columns
(``text_path``, ``latent_key``... : `data.latents`) ride along where present. Relative
``path``, ``latent_path`` and ``text_path`` values are resolved against the manifest's
directory, so a manifest and its files can move together.

Validation is vectorised (boolean masks over whole columns): a bad row is reported by number,
with the first few offenders and a count, in one UserError that names file, column and fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from adaptiveload.errors import UserError

REQUIRED = ("sample_id", "num_frames", "height", "width")
OPTIONAL = ("fps", "path", "caption", "latent_path")
COLUMNS = REQUIRED + OPTIONAL
SIZE_COLUMNS = ("num_frames", "height", "width")
MAX_PIXELS = 16384  # per side; anything larger is a unit or parsing mistake, not a video
MAX_FRAMES = 100_000
_LIMITS = {"num_frames": MAX_FRAMES, "height": MAX_PIXELS, "width": MAX_PIXELS}
_PATH_COLUMNS = ("path", "latent_path")
_SHOW = 5  # offending rows quoted in a message


def load_manifest(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read and validate a manifest; raise UserError on the first invalid column."""
    path = Path(path)
    raw = _read(path)
    return validate_manifest(raw, origin=str(path), base_dir=path.parent, csv=_is_csv(path))


def validate_manifest(
    raw: pd.DataFrame, origin: str, base_dir: Path | None = None, csv: bool = False,
    frame: bool = False,
) -> pd.DataFrame:
    """Check a raw manifest frame and return it typed: sizes int64, ids str, optionals present.

    The one validator of manifests: every entry (the file readers, the synthetic mixtures,
    `PlanBatchSampler.from_manifest`, the CLI) passes through it, so no invalid row reaches
    bucketing (where a clip of 0 or NaN frames would otherwise land in some bucket).
    `origin` names the source in messages; rows are referenced as 1-based data rows, as file
    line numbers with `csv` (header = 1), or as 0-based positions (``df.iloc[i]``) with
    `frame` (a DataFrame the caller built).
    """
    if not isinstance(raw, pd.DataFrame):
        raise UserError(f"{origin}: a manifest is a pandas DataFrame, got {type(raw).__name__}")
    where = _Problems(origin, csv, frame)
    raw = raw.reset_index(drop=True)  # row numbers in messages are positions
    if len(raw) == 0:
        raise UserError(f"{origin}: no samples (a header but no rows); expected one row per sample")
    missing = [c for c in REQUIRED if c not in raw.columns]
    if missing:
        raise UserError(
            f"{origin}: missing column(s) {', '.join(missing)}; a manifest needs "
            f"{', '.join(REQUIRED)} (optional: {', '.join(OPTIONAL)})"
        )
    out = pd.DataFrame(index=pd.RangeIndex(len(raw)))
    out["sample_id"] = _sample_ids(raw["sample_id"], where)
    for col in SIZE_COLUMNS:
        out[col] = _sizes(raw[col], col, where)
    out["fps"] = _fps(raw["fps"], where) if "fps" in raw.columns else np.nan
    for col in ("path", "caption", "latent_path"):
        absent = pd.Series(pd.NA, index=out.index, dtype="str")
        out[col] = _text(raw[col]) if col in raw.columns else absent
    where.raise_if_any()
    if base_dir is not None:
        for col in _PATH_COLUMNS:
            out[col] = _resolve(out[col], base_dir)
    extra = [c for c in raw.columns if c not in COLUMNS]
    for col in extra:  # unknown columns ride along untouched
        out[col] = raw[col].to_numpy()
    if base_dir is not None and "text_path" in out.columns:  # the latent cache's (latents.py)
        out["text_path"] = _resolve(_text(out["text_path"]), base_dir)
    return out


def write_manifest(path: str | os.PathLike[str], frame: pd.DataFrame) -> None:
    """Write a manifest atomically as CSV or Parquet, chosen by the extension."""
    from adaptiveload.io import atomic_path, write_parquet

    path = Path(path)
    check_manifest_suffix(path)
    if _is_csv(path):
        with atomic_path(path) as tmp:
            frame.to_csv(tmp, index=False)
    else:
        write_parquet(path, frame)


def check_manifest_suffix(path: Path) -> None:
    if path.suffix.lower() not in (".csv", ".parquet", ".pq"):
        raise UserError(
            f"{path}: unknown manifest format '{path.suffix}'; expected .csv or .parquet"
        )


# --- reading -------------------------------------------------------------------------------


def _is_csv(path: Path) -> bool:
    return path.suffix.lower() == ".csv"


def _read(path: Path) -> pd.DataFrame:
    check_manifest_suffix(path)
    if not path.is_file():
        raise UserError(f"{path}: no such manifest file")
    if path.stat().st_size == 0:
        raise UserError(f"{path}: file is empty; expected a header row and one row per sample")
    try:
        if _is_csv(path):
            return _read_csv(path)
        return pd.read_parquet(path)
    except Exception as exc:  # parser errors come in many library-specific types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{path}: cannot be parsed as {path.suffix[1:]}: {first}") from None


def _read_csv(path: Path) -> pd.DataFrame:
    """Parse with pyarrow (1M rows in ~0.3 s), keeping ids as text ("007" is not 7).

    pyarrow itself, not pandas' pyarrow engine: that engine casts the whole frame after a
    `dtype=` argument, so an integer column with an empty cell (fps of an image) fails with
    "cannot convert NA to integer". Here empty cells become nulls (NaN in numeric columns),
    which the column checks below report by line or accept for optional columns.
    """
    import pyarrow as pa
    from pyarrow import csv as pa_csv

    options = pa_csv.ConvertOptions(column_types={"sample_id": pa.string()})
    return pa_csv.read_csv(path, convert_options=options).to_pandas()


# --- column checks -------------------------------------------------------------------------


class _Problems:
    """Collects one problem per bad column, so a single message lists every column to fix.

    Rows are 1-based data rows (Parquet), file lines (CSV, header = line 1) or 0-based
    positions (a DataFrame).
    """

    def __init__(self, origin: str, csv: bool, frame: bool = False) -> None:
        self.origin = origin
        self.offset = 2 if csv else 0 if frame else 1
        self.unit = "line" if csv else "position" if frame else "row"
        self.found: list[str] = []

    def fail(self, bad: np.ndarray, column: str, values: pd.Series, expected: str) -> bool:
        """Record the rows where `bad` holds; True if there were any."""
        idx = np.flatnonzero(bad)
        if idx.size == 0:
            return False
        shown = ", ".join(f"{i + self.offset} ({_quote(values.iloc[i])})" for i in idx[:_SHOW])
        more = f" and {idx.size - _SHOW} more" if idx.size > _SHOW else ""
        plural = "s" if idx.size > 1 else ""
        self.found.append(
            f"column '{column}': {idx.size} bad row{plural}, at "
            f"{self.unit}{plural} {shown}{more}; expected {expected}"
        )
        return True

    def raise_if_any(self) -> None:
        if self.found:
            raise UserError(f"{self.origin}: " + " | ".join(self.found))


def _quote(value: object) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)) or value is pd.NA:
        return "empty"
    text = repr(value.item() if hasattr(value, "item") else value)
    return text if len(text) <= 40 else text[:37] + "..."


# what an empty id most often is: text that pandas' CSV reader turned into a missing value
_NA_TEXT_HINT = (
    "; pandas.read_csv reads ids such as 'NaN', 'null' or 'NA' as empty: read the file with "
    "adaptiveload.data.manifest.load_manifest(path), or pd.read_csv(path, "
    "dtype={'sample_id': str}, keep_default_na=False)"
)


def _sample_ids(col: pd.Series, where: _Problems) -> pd.Series:
    missing = col.isna().to_numpy()
    ids = col.astype("str")
    empty = missing | (ids.str.strip() == "").to_numpy()
    hint = _NA_TEXT_HINT if missing.any() else ""
    if where.fail(empty, "sample_id", col, "a non-empty string" + hint):
        return ids
    if pd.Index(ids).is_unique:  # the common case, twice as fast as duplicated() on 1M ids
        return ids
    dup = ids.duplicated(keep=False).to_numpy()
    if dup.any():
        repeated = ids[dup]
        shown = []
        for sid in repeated.unique()[:_SHOW]:
            at = np.flatnonzero((ids == sid).to_numpy())[:_SHOW] + where.offset
            shown.append(f"{sid!r} ({where.unit}s {', '.join(map(str, at))})")
        n_ids = repeated.nunique()
        more = f" and {n_ids - _SHOW} more" if n_ids > _SHOW else ""
        where.found.append(
            f"column 'sample_id': {int(dup.sum())} rows share {n_ids} id(s): "
            f"{', '.join(shown)}{more}; expected every sample_id to be unique (rename or "
            "drop the repeats)"
        )
    return ids


def _numeric(col: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(float values, mask of entries that are present but not numbers)."""
    if pd.api.types.is_bool_dtype(col):
        return col.to_numpy(dtype=np.float64), np.ones(len(col), dtype=bool)
    if pd.api.types.is_numeric_dtype(col):
        return col.to_numpy(dtype=np.float64, na_value=np.nan), np.zeros(len(col), dtype=bool)
    num = pd.to_numeric(col, errors="coerce")
    values = num.to_numpy(dtype=np.float64, na_value=np.nan)
    # to_numeric reads True as 1: a flag in a size column is a mistake, not one frame
    flags = col.map(lambda v: isinstance(v, (bool, np.bool_))).to_numpy(dtype=bool)
    return values, (np.isnan(values) & col.notna().to_numpy()) | flags


def _sizes(col: pd.Series, name: str, where: _Problems) -> np.ndarray:
    """int64 sizes; the first failing check of the column is recorded (zeros returned then)."""
    limit = _LIMITS[name]
    unit = "frames" if name == "num_frames" else "pixels"
    expected = f"a whole number of {unit} from 1 to {limit}"
    if pd.api.types.is_integer_dtype(col) and not col.isna().any():  # the Parquet fast path
        values = col.to_numpy(dtype=np.int64)
        where.fail((values < 1) | (values > limit), name, col, expected)
        return values
    values, not_a_number = _numeric(col)
    checks = (
        (not_a_number, expected),
        (np.isnan(values), expected + " (the cell is empty)"),
        (values != np.floor(values), expected + " (not a whole number)"),
        ((values < 1) | (values > limit), expected),
    )
    for bad, text in checks:
        if where.fail(bad, name, col, text):
            return np.zeros(len(col), dtype=np.int64)
    return values.astype(np.int64)


def _fps(col: pd.Series, where: _Problems) -> np.ndarray:
    values, not_a_number = _numeric(col)
    expected = "frames per second, a number > 0, or an empty cell"
    out_of_range = ~np.isnan(values) & ~((values > 0) & (values < 10_000))
    if not where.fail(not_a_number, "fps", col, expected):
        where.fail(out_of_range, "fps", col, expected)
    return values


def _text(col: pd.Series) -> pd.Series:
    out = col.astype("str")
    return out.mask(col.isna() | (out == ""))


def _resolve(col: pd.Series, base: Path) -> pd.Series:
    rel = col.notna() & ~col.str.startswith("/").fillna(False).astype(bool)
    if not rel.any():
        return col
    out = col.copy()
    out[rel] = str(base.resolve()) + os.sep + col[rel]
    return out

"""Tuning records and cost models: a Parquet dataset on a local folder or any pyarrow/fsspec URL."""
from tensortune.storage.models import ModelStore
from tensortune.storage.records import MeasureRecord, RecordStore, TrainingRow

__all__ = ["MeasureRecord", "ModelStore", "RecordStore", "TrainingRow"]

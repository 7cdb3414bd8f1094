"""The protocol spec (spec/protocol.toml): loading, checking against the code, rendering."""

from pdflow.spec.check import SpecDifference, check_spec
from pdflow.spec.load import Spec, load_spec, spec_path, spec_sha256

__all__ = ["Spec", "SpecDifference", "check_spec", "load_spec", "spec_path", "spec_sha256"]

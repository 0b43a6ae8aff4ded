"""Field values are read through ctypes' own accessors; each value type must still give its number."""

from __future__ import annotations

import pynvml
import pytest
from gpuhealth.exporter.nvml_fields import answers, value_members

MEMBERS = [(pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", 2.5e-9), (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 7),
           (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG, "ulVal", 2**40),
           (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 2**63 + 5),
           (pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, "sllVal", -3),
           (pynvml.NVML_VALUE_TYPE_SIGNED_INT, "siVal", -4),
           (pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT, "usVal", 65535)]


@pytest.mark.parametrize(("value_type", "member", "number"), MEMBERS)
def test_every_value_type_gives_its_number(value_type: int, member: str, number: float) -> None:
    values = (pynvml.c_nvmlFieldValue_t * 2)()
    values[0].valueType = value_type
    setattr(values[0].value, member, number)
    values[1].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
    assert list(answers(values, value_members(pynvml))) == [
        (pynvml.NVML_SUCCESS, float(number)), (pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0)]

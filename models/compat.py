"""The few Python 3.11 features the code uses, for Python 3.10 too (JetPack 6 ships 3.10).

In the lowest layer so that every package may import it; it imports nothing of ours and no framework.
"""

from __future__ import annotations

import sys
from enum import Enum

__all__ = ["StrEnum", "timeout"]

if sys.version_info >= (3, 11):
    from asyncio import timeout
    from enum import StrEnum
else:
    # The backport of asyncio.timeout. It raises asyncio.TimeoutError, which is the builtin TimeoutError from
    # 3.11 on but not on 3.10: callers catch asyncio.TimeoutError.
    from async_timeout import timeout

    class StrEnum(str, Enum):
        """enum.StrEnum of 3.11: the members are strings, and str() and format() give the value, not the name."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, format_spec: str) -> str:
            return str(self.value).__format__(format_spec)

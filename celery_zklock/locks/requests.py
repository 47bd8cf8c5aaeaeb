"""ZooKeeper requests that kazoo 2.11 has no public API for.

Both are sent through ``KazooClient._call``, the same path kazoo's own ``*_async`` methods use.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kazoo.protocol.serialization import (
    ZnodeStat,
    int_struct,
    read_string,
    stat_struct,
    write_buffer,
    write_string,
)
from kazoo.security import ACL, OPEN_ACL_UNSAFE

#: ZooKeeper's CreateMode.CONTAINER flag.
CONTAINER_FLAGS = 4
#: RemoveWatches watcher types (org.apache.zookeeper.Watcher.WatcherType).
DATA_WATCHES = 2


class CreateContainer:
    """``createContainer`` (opcode 19): a parent the server deletes once its last child is gone.

    The request body is a CreateRequest with the CONTAINER flag; the response is a
    Create2Response (path and stat).
    """

    type: ClassVar[int] = 19

    def __init__(self, path: str, data: bytes, acl: list[ACL], flags: int) -> None:
        self.path = path
        self.data = data
        self.acl = acl
        self.flags = flags

    def serialize(self) -> bytearray:
        body = bytearray()
        body.extend(write_string(self.path))
        body.extend(write_buffer(self.data))
        body.extend(int_struct.pack(len(self.acl)))
        for acl in self.acl:
            body.extend(int_struct.pack(acl.perms))
            body.extend(write_string(acl.id.scheme))
            body.extend(write_string(acl.id.id))
        body.extend(int_struct.pack(self.flags))
        return body

    @classmethod
    def deserialize(cls, data: bytes, offset: int) -> tuple[str, ZnodeStat]:
        path, offset = read_string(data, offset)
        return path, ZnodeStat._make(stat_struct.unpack_from(data, offset))


class RemoveWatches:
    """``removeWatches`` (opcode 18): drop this session's watches of one type on one path."""

    type: ClassVar[int] = 18

    def __init__(self, path: str, watcher_type: int) -> None:
        self.path = path
        self.watcher_type = watcher_type

    def serialize(self) -> bytearray:
        body = bytearray()
        body.extend(write_string(self.path))
        body.extend(int_struct.pack(self.watcher_type))
        return body

    @classmethod
    def deserialize(cls, data: bytes, offset: int) -> None:
        return None


def create_container_async(client: Any, path: str, acl: list[ACL] | None = None) -> Any:
    """Send ``createContainer`` for ``path``; returns kazoo's async result (path, stat)."""
    result = client.handler.async_result()
    request = CreateContainer(
        client.chroot + path if client.chroot else path,
        b"",
        list(acl if acl is not None else (client.default_acl or OPEN_ACL_UNSAFE)),
        CONTAINER_FLAGS,
    )
    client._call(request, result)
    return result


def remove_data_watches_async(client: Any, path: str) -> Any:
    """Send ``removeWatches`` for this session's data watches on ``path``."""
    result = client.handler.async_result()
    full = client.chroot + path if client.chroot else path
    client._call(RemoveWatches(full, DATA_WATCHES), result)
    return result

# The record format as delayserver/storage/record.py defines it, for the kernels that read and
# write records (cimported; records.FORMAT holds these for tests/test_native.py to compare with
# record.py).

cdef enum:
    HEADER_SIZE = 9         # crc u32, length u32, type u8 (record.HEADER)
    OFFSET_SIZE = 8         # record.OFFSET
    MESSAGE_HEAD_SIZE = 36  # record.MESSAGE_HEAD
    CANCEL_HEAD_SIZE = 25   # record.CANCEL_HEAD
    TXN_PREFIX_SIZE = 24    # record._TXN_PREFIX
    SCHEDULED_HEAD_SIZE = 44  # record.SCHEDULED_HEAD: OFFSET + MESSAGE_HEAD
    DELIVERED_HEAD_SIZE = 12  # record.DELIVERED_HEAD: dispatch time i64, attempt u32
    DISPATCH_HEAD_SIZE = 17   # record.DISPATCH_HEAD: schedule offset u64, dispatch time i64, group length u8
    MAX_PAYLOAD_BYTES = 64 << 20  # record.MAX_PAYLOAD_BYTES
    MAX_HEADERS_BYTES = 32 << 10  # message.MAX_HEADERS_BYTES

# Record types, as record.RecordType numbers them (the tests compare FORMAT with it).
cdef enum:
    T_MESSAGE = 1
    T_CANCEL = 2
    T_SCHEDULED = 3
    T_SCHEDULED_CANCEL = 4
    T_DISPATCH = 5
    T_DELIVERED = 6
    T_EPOCH = 12
    T_PREPARE = 16
    T_COMMIT = 17
    T_ROLLBACK = 18
    T_TXN_CHECK = 19
    T_TXN_PARK = 20
    T_SCHEDULE = 24

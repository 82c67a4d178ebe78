"""A SentencePiece model built from a GGUF vocabulary: the reference our rebuilt tokenizer is
checked against. The ModelProto is encoded by hand (a few protobuf fields) so the check
needs only the `sentencepiece` wheel, not protobuf."""

import struct

from gumiho.gguf_convert import USER_DEFINED, spm_pieces


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _message(number: int, body: bytes) -> bytes:
    return _field(number, 2, _varint(len(body)) + body)


def _int(number: int, value: int) -> bytes:
    return _field(number, 0, _varint(value))


def model_proto(vocab: dict) -> bytes:
    """sentencepiece ModelProto: pieces (1), trainer_spec (2), normalizer_spec (3)."""
    out = bytearray()
    pieces = spm_pieces(vocab)
    for piece, score, kind in zip(pieces, vocab["scores"], vocab["types"], strict=True):
        body = (_message(1, piece.encode()) + _field(2, 5, struct.pack("<f", score))
                + _int(3, kind if kind != USER_DEFINED or piece else 1))
        out += _message(1, body)
    trainer = (_int(3, 2)  # model_type BPE
               + _int(35, 1)  # byte_fallback
               + _int(40, vocab["unk_id"]) + _int(41, vocab["bos_id"])
               + _int(42, vocab["eos_id"]) + _int(43, vocab["pad_id"]))
    out += _message(2, trainer)
    normalizer = (_message(1, b"identity") + _int(3, int(vocab["add_space_prefix"]))
                  + _int(4, 0) + _int(5, 1))
    out += _message(3, normalizer)
    return bytes(out)


def sentencepiece_processor(vocab: dict):
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_proto=model_proto(vocab))

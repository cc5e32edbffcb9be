"""The SASS readers of tests/kernels/sass.py on hand-written instruction lists (their use on
real kernels: the sm_90 compile facts of tests/kernels/test_moe.py and test_linear.py)."""

from tests.kernels.sass import NONE, Instr, loop_own_load_waits, parse


def _code(*rows) -> list[Instr]:
    """rows: (text, set_on_write, wait_mask) at addresses 0x10, 0x20, …"""
    return [Instr(t, s, w, 0x10 * (i + 1)) for i, (t, s, w) in enumerate(rows)]


def test_a_pass_waiting_for_its_own_loads_counts_each_wait():
    code = _code(("MOV R1, R2", NONE, 0),  # 0x10: before the loop
                 ("LDG.E R4, desc[UR4][R2.64]", 2, 0),  # 0x20: the loop's head
                 ("LDG.E R5, desc[UR4][R6.64]", 3, 0),
                 ("HMMA.16816.F32 R8, R10, R12, R8", NONE, 0),
                 ("FMUL R9, R4, R4", NONE, 0b000100),  # waits for the first load
                 ("FMUL R9, R5, R9", NONE, 0b001000),  # then for the second: a second trip
                 ("@P0 BRA 0x20", NONE, 0),
                 ("EXIT", NONE, 0))
    assert loop_own_load_waits(code) == 2


def test_loads_carried_into_the_next_pass_do_not_count_and_shared_scoreboards_do():
    carried = _code(("FMUL R9, R4, R4", NONE, 0b000100),  # 0x10, the head: last pass's load
                    ("HMMA.16816.F32 R8, R10, R12, R8", NONE, 0),
                    ("LDG.E R4, desc[UR4][R2.64]", 2, 0),  # for the next pass
                    ("@P0 BRA 0x10", NONE, 0))
    assert loop_own_load_waits(carried) == 0
    shared = _code(("LDG.E R4, desc[UR4][R2.64]", 2, 0),
                   ("LDSM.16.M88.4 R8, [R3]", 2, 0),  # the same scoreboard
                   ("F2FP.F16.E4M3.UNPACK_B R20, R8", NONE, 0b000100),  # waits for both
                   ("@P0 BRA 0x10", NONE, 0))
    assert loop_own_load_waits(shared) == 1
    tiles = _code(("LDGSTS.E.BYPASS.128 [R47], desc[UR16][R24.64]", NONE, 0),  # cp.async
                  ("DEPBAR.LE SB0, 0x4", NONE, 0), ("@P0 BRA 0x10", NONE, 0))
    assert loop_own_load_waits(tiles) == 0


def test_no_loop_and_the_widest_loop():
    straight = _code(("LDG.E R4, desc[UR4][R2.64]", 2, 0), ("FMUL R9, R4, R4", NONE, 0b100),
                     ("EXIT", NONE, 0), ("BRA 0x40", NONE, 0))  # the trailing self-branch
    assert loop_own_load_waits(straight) == 0
    two = _code(("LDG.E R4, desc[UR4][R2.64]", 2, 0),  # 0x10: the outer loop's head
                ("FMUL R9, R4, R4", NONE, 0b100),
                ("LDG.E R5, desc[UR4][R2.64]", 3, 0),  # 0x30: an inner loop
                ("FMUL R9, R5, R9", NONE, 0b1000),
                ("@P1 BRA 0x30", NONE, 0),
                ("@P0 BRA 0x10", NONE, 0))
    assert loop_own_load_waits(two) == 2  # the outer one, the inner one inside it


def test_parse_keeps_addresses():
    text = ("        /*0040*/                   LDG.E R2, desc[UR16][R2.64] ;"
            "                  /* 0x000000100202b981 */\n"
            "                                                                   "
            "                   /* 0x000ea2000c1e1900 */\n")
    (ins,) = parse(text + "\n")
    assert ins.addr == 0x40 and ins.opcode == "LDG.E" and ins.set_on_write == 2

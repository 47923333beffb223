"""The two halves of the `code` domain's test harness, each run in its own sandbox
(`rollwire.reward.code`): `program.py` runs the program under test and answers calls;
`judge.py` runs the tests and decides. They share only two pipes and `codec`'s plain
data."""

"""Doctor placeholder (device checks come with the doctor)."""


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    print("doctor: not available yet")
    return 2

from attnprobe.cli import main

main()

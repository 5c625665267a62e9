from ironflow.cli import main

main()

from tfq.cli import main

main()
